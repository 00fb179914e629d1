"""The stage end of a lane (`stagerun._proto._stage_lane`): (state, message) -> commands.

In the style of h11's state tests: every kind of message, on a middle stage and on the last,
with the commands it must produce written out here in full, apart from the code and the
table. Changing one row of `stagerun._proto._lane.RULES` (what a message owes, or where its
failure goes) changes the commands of a row below, and that row's test fails.
"""

from __future__ import annotations

import attrs
import pytest

from stagerun import _proto
from stagerun._errors import ProtocolError
from stagerun._proto._stage_lane import (
    AckUp,
    Close,
    Compute,
    DropQueued,
    Fail,
    Open,
    OwedAck,
    PassOn,
    RelayUp,
    RememberBlocks,
    Reply,
    SendCancelled,
    SendDown,
    SendStatus,
    StageLane,
    TrimCache,
)

RID = 5
NOW = 100.0
ONE = _proto.StageStats(stage_count=1)
STATS = _proto.StageStats(compute_us=40, stage_count=1, token_count=2)
SESSION = "session-5"  # the shell's session object: opaque to the lane
ACTS = "activations"
OUT = "output"

CONFIGURE = _proto.Configure(
    request_id=RID, return_key=9, prompt_len=4, sampling=_proto.SamplingParams()
)
PREFILL = _proto.Prefill(request_id=RID, chunk_index=0, position=0, tokens=(1, 2), predict=False)
PREFILL_LAST = _proto.Prefill(request_id=RID, chunk_index=1, position=2, tokens=(3,), predict=True)
DECODE = _proto.Decode(request_id=RID, position=3, tokens=(4,))
VERIFY = _proto.Verify(request_id=RID, window_id=2, epoch=0, position=4, tokens=(5, 6))
TRIM = _proto.Trim(request_id=RID, position=2)
STOP = _proto.Stop(request_id=RID)
CANCEL = _proto.Cancel(request_id=RID, epoch=0, window_ids=(2, 3))
REMEMBER = _proto.Remember(request_id=RID, prefix=(11, 12))
PROBE = _proto.Probe(request_id=RID)


def lane(*, last: bool, session: bool = True) -> StageLane[str]:
    state: StageLane[str] = StageLane(is_last=last, max_sessions=2)
    if session:
        state.sessions[RID] = SESSION
    return state


def owed(stats: _proto.StageStats = ONE, cached: int = 0) -> OwedAck:
    return OwedAck(RID, stats, NOW, cached)


# --- a message read from upstream: (message, stage holds the session) -> commands ------------

MIDDLE = [
    (CONFIGURE, False, [Open(CONFIGURE)]),
    (CONFIGURE, True, [Close(RID, SESSION, False), Open(CONFIGURE)]),
    (PREFILL, True, [Compute(PREFILL, SESSION, ACTS)]),
    (PREFILL_LAST, True, [Compute(PREFILL_LAST, SESSION, ACTS)]),
    (DECODE, True, [Compute(DECODE, SESSION, ACTS)]),
    (VERIFY, True, [Compute(VERIFY, SESSION, ACTS)]),
    (PREFILL, False, [Fail(RID, "request 5 was not configured on this lane", upstream=True)]),
    (DECODE, False, [Fail(RID, "request 5 was not configured on this lane", upstream=True)]),
    (TRIM, True, [TrimCache(SESSION, 2), PassOn(TRIM, owed())]),
    (TRIM, False, [PassOn(TRIM, owed())]),
    (STOP, True, [Close(RID, SESSION, True), PassOn(STOP, owed())]),
    (STOP, False, [PassOn(STOP, owed())]),
    (CANCEL, True, [PassOn(CANCEL, None)]),
    (REMEMBER, True, [PassOn(REMEMBER, None), RememberBlocks(SESSION, (11, 12))]),
    (REMEMBER, False, [PassOn(REMEMBER, None)]),
    (PROBE, True, [SendStatus(RID)]),
]

LAST = [
    (CONFIGURE, False, [Open(CONFIGURE)]),
    (CONFIGURE, True, [Close(RID, SESSION, False), Open(CONFIGURE)]),
    (PREFILL, True, [Compute(PREFILL, SESSION, ACTS)]),
    (VERIFY, True, [Compute(VERIFY, SESSION, ACTS)]),
    (PREFILL, False, [Fail(RID, "request 5 was not configured on this lane", upstream=True)]),
    (PREFILL_LAST, False, [Fail(RID, "request 5 was not configured on this lane", upstream=False)]),
    (DECODE, False, [Fail(RID, "request 5 was not configured on this lane", upstream=False)]),
    (VERIFY, False, [Fail(RID, "request 5 was not configured on this lane", upstream=False)]),
    (TRIM, True, [TrimCache(SESSION, 2), AckUp(RID, ONE)]),
    (STOP, True, [Close(RID, SESSION, True), AckUp(RID, ONE)]),
    (STOP, False, [AckUp(RID, ONE)]),
    (CANCEL, True, [SendCancelled(RID, 0, (2, 3))]),
    (REMEMBER, True, [RememberBlocks(SESSION, (11, 12))]),
    (REMEMBER, False, []),
    (PROBE, False, [SendStatus(RID)]),
]  # fmt: skip


@pytest.mark.parametrize(("message", "held", "commands"), MIDDLE)
def test_middle_stage_receives(message: _proto.Message, held: bool, commands: list) -> None:
    assert lane(last=False, session=held).receive(message, ACTS, now=NOW) == commands


@pytest.mark.parametrize(("message", "held", "commands"), LAST)
def test_last_stage_receives(message: _proto.Message, held: bool, commands: list) -> None:
    assert lane(last=True, session=held).receive(message, ACTS, now=NOW) == commands


# --- what the shell reports back: (stage, outcome) -> commands ------------------------------


@pytest.mark.parametrize(
    ("last", "message", "commands"),
    [
        (False, PREFILL, [SendDown(PREFILL, SESSION, OUT, STATS, owed(STATS))]),
        (False, PREFILL_LAST, [SendDown(PREFILL_LAST, SESSION, OUT, STATS, None)]),
        (False, DECODE, [SendDown(DECODE, SESSION, OUT, STATS, None)]),
        (False, VERIFY, [SendDown(VERIFY, SESSION, OUT, STATS, None)]),
        (True, PREFILL, [AckUp(RID, STATS)]),
        (True, PREFILL_LAST, [Reply(PREFILL_LAST, SESSION, OUT, STATS)]),
        (True, DECODE, [Reply(DECODE, SESSION, OUT, STATS)]),
        (True, VERIFY, [Reply(VERIFY, SESSION, OUT, STATS)]),
    ],
)
def test_computed(last: bool, message: _proto.ActivationMessage, commands: list) -> None:
    state = lane(last=last)
    state.receive(message, ACTS, now=NOW)
    assert state.computed(message, OUT, STATS, now=NOW) == commands
    assert list(state.owed) == [c.owed for c in commands if isinstance(c, SendDown) and c.owed]


@pytest.mark.parametrize(
    ("last", "message", "upstream"),
    [
        (False, PREFILL, True),
        (False, DECODE, True),
        (False, VERIFY, True),
        (True, PREFILL, True),
        (True, PREFILL_LAST, False),
        (True, DECODE, False),
        (True, VERIFY, False),
    ],
)
def test_compute_failed(last: bool, message: _proto.ActivationMessage, upstream: bool) -> None:
    state = lane(last=last)
    state.receive(message, ACTS, now=NOW)
    assert state.compute_failed(message, "bad rows") == [Fail(RID, "bad rows", upstream=upstream)]
    assert state.current is None


@pytest.mark.parametrize("last", [False, True])
def test_opened_and_refused(last: bool) -> None:
    state = lane(last=last, session=False)
    assert state.refused(CONFIGURE, "no room") == [Fail(RID, "no room", upstream=True)]
    assert state.sessions == {}
    opened = state.opened(CONFIGURE, SESSION, cached=3, now=NOW)
    if last:
        assert opened == [AckUp(RID, ONE, cached=3)]
    else:
        assert opened == [PassOn(CONFIGURE, owed(cached=3), fresh_session=True)]
    assert state.sessions == {RID: SESSION}


def test_a_busy_downstream_is_not_fresh() -> None:
    """A Configure behind unacknowledged work must not replace the downstream connection."""
    state = lane(last=False)
    state.receive(TRIM, now=NOW)  # owes an ack
    assert state.opened(CONFIGURE, SESSION, cached=0, now=NOW) == [
        PassOn(CONFIGURE, owed(), fresh_session=False)
    ]


@pytest.mark.parametrize("last", [False, True])
@pytest.mark.parametrize(
    "reply",
    [
        _proto.Ack(request_id=RID, stats=ONE),
        _proto.Predictions(request_id=RID, window_id=0, position=3, tokens=(4,)),
        _proto.Cancelled(request_id=RID, epoch=0, window_ids=(2,)),
        _proto.Error(request_id=RID, stage_index=2, message="no"),
        _proto.Status(request_id=RID, stage_index=1, prefix=_proto.PrefixStats()),
    ],
)
def test_a_reply_from_upstream_closes_the_lane(last: bool, reply: _proto.Message) -> None:
    with pytest.raises(ProtocolError, match="is a reply"):
        lane(last=last).receive(reply)


def test_configure_past_the_lane_limit_closes_the_lane() -> None:
    state = lane(last=False)
    state.sessions[6] = "session-6"
    with pytest.raises(ProtocolError, match="more than 2 requests on one lane"):
        state.receive(attrs.evolve(CONFIGURE, request_id=7))
    # the same id replaces its session instead
    assert state.receive(CONFIGURE) == [Close(RID, SESSION, False), Open(CONFIGURE)]


# --- cancellation --------------------------------------------------------------------------------


def test_a_cancel_read_ahead_drops_the_queue_and_stops_the_window_it_names() -> None:
    state = lane(last=False)
    state.receive(VERIFY, ACTS)  # being computed
    (drop,) = state.read_ahead(CANCEL)
    assert drop == DropQueued(RID, frozenset({2, 3}))
    assert drop.names(VERIFY) and not drop.names(DECODE)
    assert not drop.names(attrs.evolve(VERIFY, window_id=4))
    assert state.current_cancelled
    assert state.compute_stopped(VERIFY) == []
    assert state.current is None and not state.current_cancelled


def test_a_cancel_of_other_windows_leaves_the_compute_alone() -> None:
    state = lane(last=False)
    state.receive(VERIFY, ACTS)
    state.read_ahead(_proto.Cancel(request_id=RID, epoch=0, window_ids=(7,)))
    assert not state.current_cancelled


def test_the_last_stage_cancels_only_what_it_has_not_answered() -> None:
    state = lane(last=True)
    state.receive(VERIFY, ACTS)
    state.computed(VERIFY, OUT, STATS, now=NOW)  # window 2 answered
    assert state.receive(CANCEL) == [SendCancelled(RID, 0, (3,))]
    state.receive(STOP)  # the request ended: what it answered is forgotten
    state.sessions[RID] = SESSION
    assert state.receive(CANCEL) == [SendCancelled(RID, 0, (2, 3))]


# --- acks from downstream ----------------------------------------------------------------------


def test_a_downstream_ack_is_merged_into_the_ack_owed_in_order() -> None:
    state = lane(last=False)
    first = state.receive(TRIM, now=NOW)[-1]
    second = state.receive(STOP, now=NOW)[-1]
    assert isinstance(first, PassOn) and isinstance(second, PassOn)
    below = _proto.StageStats(compute_us=7, stage_count=2)
    (ack,) = state.downstream_replied(
        _proto.Ack(request_id=RID, stats=below), now=NOW + 0.002, index=1
    )
    merged = _proto.StageStats(compute_us=7, stage_count=3, downstream_wait_us=2000)
    assert ack == AckUp(RID, merged)
    assert list(state.owed) == [second.owed]


def test_a_prefill_chunk_ack_names_this_hop_as_its_edge() -> None:
    state = lane(last=False)
    stats = _proto.StageStats(
        compute_us=50, forward_write_us=30, stage_count=1, slowest_compute_us=50, slowest_tokens=2
    )
    state.receive(PREFILL, ACTS)
    (forward,) = state.computed(PREFILL, OUT, stats, now=NOW)
    assert isinstance(forward, SendDown) and forward.owed is not None
    (ack,) = state.downstream_replied(
        _proto.Ack(request_id=RID, stats=_proto.StageStats(stage_count=1), cached=0),
        now=NOW + 0.001,
        index=1,
    )
    assert isinstance(ack, AckUp)
    assert (ack.stats.edge_write_us, ack.stats.edge_wait_us, ack.stats.edge_stage) == (30, 1000, 1)


def test_a_configure_ack_keeps_what_every_stage_below_restored() -> None:
    state = lane(last=False, session=False)
    state.opened(CONFIGURE, SESSION, cached=64, now=NOW)
    (ack,) = state.downstream_replied(
        _proto.Ack(request_id=RID, stats=ONE, cached=32), now=NOW, index=1
    )
    assert isinstance(ack, AckUp) and ack.cached == 32


@pytest.mark.parametrize("owing", [False, True])
def test_anything_else_from_downstream_travels_up_unchanged(owing: bool) -> None:
    state = lane(last=False)
    if owing:
        state.receive(TRIM)
    error = _proto.Error(request_id=RID, stage_index=2, message="no room")
    assert state.downstream_replied(error, now=NOW, index=1) == [RelayUp(error)]
    ack = _proto.Ack(request_id=RID, stats=ONE)
    assert state.downstream_replied(ack, now=NOW, index=1) == [RelayUp(ack)]  # nothing owed


def test_closing_the_lane_drops_every_session() -> None:
    state = lane(last=False)
    state.sessions[6] = "session-6"
    assert state.close() == [Close(RID, SESSION, False), Close(6, "session-6", False)]
    assert state.sessions == {}
