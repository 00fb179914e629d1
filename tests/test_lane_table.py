"""The lane's table (`stagerun._proto._lane`), row by row, in the style of h11's state tests.

Each expected row is written out here, apart from the table: changing one row of `RULES`
(what a message owes, whether it is passed on, whether it computes) or one case of
`check_reply` fails a test that names it.
"""

from __future__ import annotations

import pytest

from stagerun import _proto
from stagerun._proto import Owes, ReplyCheck

SAMPLING = _proto.SamplingParams()
STATS = _proto.StageStats()

# one request of every kind, and what the table must say of it:
# (message, owes, passed on, computes, fails upstream on a middle stage, ... on the last)
REQUESTS = [
    (_proto.Configure(request_id=1, return_key=7, prompt_len=3, sampling=SAMPLING),
     Owes.ACK, True, False, True, True),
    (_proto.Prefill(request_id=1, chunk_index=0, position=0, tokens=(1, 2), predict=False),
     Owes.ACK, True, True, True, True),
    (_proto.Prefill(request_id=1, chunk_index=1, position=2, tokens=(3,), predict=True),
     Owes.PREDICTIONS, True, True, True, False),
    (_proto.Decode(request_id=1, position=3, tokens=(4,)),
     Owes.PREDICTIONS, True, True, True, False),
    (_proto.Verify(request_id=1, window_id=2, epoch=0, position=4, tokens=(5, 6)),
     Owes.PREDICTIONS, True, True, True, False),
    (_proto.Trim(request_id=1, position=2), Owes.ACK, True, False, True, True),
    (_proto.Stop(request_id=1), Owes.ACK, True, False, True, True),
    (_proto.Cancel(request_id=1, epoch=0, window_ids=(2,)), Owes.NOTHING, True, False, True, True),
    (_proto.Remember(request_id=1, prefix=(9,)), Owes.NOTHING, True, False, True, True),
    (_proto.Probe(request_id=0), Owes.STATUS, False, False, True, True),
]  # fmt: skip

REPLIES = {
    "ack": _proto.Ack(request_id=1, stats=STATS),
    "predictions": _proto.Predictions(request_id=1, window_id=0, position=3, tokens=(4,)),
    "cancelled": _proto.Cancelled(request_id=1, epoch=0, window_ids=(2,)),
    "error": _proto.Error(request_id=1, stage_index=2, message="no room"),
    "status": _proto.Status(request_id=0, stage_index=1, prefix=_proto.PrefixStats()),
}

# (what is owed, the reply's kind, whether it came on the return connection) -> the check
T, R, X = ReplyCheck.TAKEN, ReplyCheck.REFUSED, ReplyCheck.OUT_OF_STEP
CHECKS = {
    Owes.ACK: {
        "ack": (T, X), "predictions": (X, X), "cancelled": (X, X), "error": (R, R),
        "status": (X, X),
    },
    Owes.PREDICTIONS: {
        "ack": (X, X), "predictions": (X, T), "cancelled": (X, T), "error": (R, R),
        "status": (X, X),
    },
    Owes.STATUS: {
        "ack": (X, X), "predictions": (X, X), "cancelled": (X, X), "error": (R, R),
        "status": (T, X),
    },
    Owes.NOTHING: {
        "ack": (X, X), "predictions": (X, X), "cancelled": (X, X), "error": (R, R),
        "status": (X, X),
    },
}  # fmt: skip


def _label(row: tuple[object, ...]) -> str:
    message = row[0]
    predict = "+predict" if isinstance(message, _proto.Prefill) and message.predict else ""
    return f"{getattr(message, 'kind', '?')}{predict}"


@pytest.mark.parametrize("row", REQUESTS, ids=_label)
def test_each_request_owes_what_its_row_says(row: tuple[object, ...]) -> None:
    message, owes, passed_on, computes, up_middle, up_last = row
    assert isinstance(message, _proto.Message)  # type: ignore[arg-type]
    rule = _proto.rule_for(message)
    assert (rule.owes, rule.passed_on, rule.computes) == (owes, passed_on, computes)
    assert _proto.fails_upstream(message, is_last=False) is up_middle
    assert _proto.fails_upstream(message, is_last=True) is up_last
    assert not _proto.is_reply(message)
    assert rule.computes == isinstance(message, _proto.ActivationMessage)  # type: ignore[arg-type]


def test_every_request_kind_has_a_row_and_every_row_a_test() -> None:
    kinds = {_label((m,)) for m, *_ in REQUESTS}
    assert kinds == set(_proto.RULES)
    replies = {"ack", "predictions", "cancelled", "error", "status"}
    assert kinds | replies == set(_proto.MESSAGE_TYPES) | {"prefill+predict"}


@pytest.mark.parametrize("kind", sorted(REPLIES))
def test_a_reply_has_no_row_and_never_travels_down(kind: str) -> None:
    reply = REPLIES[kind]
    assert _proto.is_reply(reply)
    with pytest.raises(KeyError):
        _proto.rule_for(reply)


@pytest.mark.parametrize("owed", list(Owes), ids=lambda o: o.value)
@pytest.mark.parametrize("kind", sorted(REPLIES))
@pytest.mark.parametrize("on_return", [False, True], ids=["forward", "return"])
def test_stage_0_checks_every_reply_against_the_table(
    owed: Owes, kind: str, on_return: bool
) -> None:
    expected = CHECKS[owed][kind][on_return]
    assert _proto.check_reply(owed, REPLIES[kind], on_return=on_return) is expected
