"""The lane's rules as one table: what each message owes, who answers it, where failures go.

Theory of operation: stage 0 sends requests down a lane; each stage carries them out in order
and, unless it is the last, passes them on. Every request kind owes exactly one kind of
answer, and both ends of the lane read it from `RULES`:

=========================  ===========  ========================================  =========
message                    owes         answered by                               passed on
=========================  ===========  ========================================  =========
``Configure``              Ack          every stage, hop by hop (stats merged)     yes
``Prefill``                Ack          every stage, hop by hop                    yes
``Prefill`` (``predict``)  Predictions  the last stage, on the return connection   yes
``Decode``, ``Verify``     Predictions  the last stage, on the return connection   yes
``Trim``, ``Stop``         Ack          every stage, hop by hop                    yes
``Cancel``                 nothing      (the last stage sends ``Cancelled`` back)  yes
``Remember``               nothing                                                 yes
``Probe``                  Status       the stage it reaches                       no
=========================  ===========  ========================================  =========

A failure is reported where stage 0 is listening for the answer: an ``Error`` on the return
connection for what the last stage answers there, upstream (hop by hop, like an ``Ack``)
for everything else (`fails_upstream`). Stage 0 checks every reply against the same table
(`check_reply`): the expected kind on the expected connection is taken, an ``Error`` is the
stage's refusal, anything else means the lane is out of step. Replies never travel down a
lane: a stage that reads one from its upstream closes the lane (`is_reply`).
"""

from __future__ import annotations

import enum
from typing import Final

import attrs

from ._messages import (
    Ack,
    Cancel,
    Cancelled,
    Configure,
    Decode,
    Error,
    Message,
    Predictions,
    Prefill,
    Probe,
    Remember,
    Stop,
    Trim,
    Verify,
)
from ._status import Status

__all__ = [
    "RULES",
    "Owes",
    "ReplyCheck",
    "Rule",
    "check_reply",
    "fails_upstream",
    "is_reply",
    "rule_for",
]


class Owes(enum.Enum):
    """What a request sent down a lane owes stage 0."""

    ACK = "ack"  # every stage acknowledges it, hop by hop
    PREDICTIONS = "predictions"  # the last stage answers on the return connection
    STATUS = "status"  # the stage it reaches answers, and passes nothing on
    NOTHING = "nothing"  # fire and forget


@attrs.frozen
class Rule:
    """One row of the lane's table."""

    owes: Owes
    passed_on: bool  # a stage that is not the last sends it on down the lane
    computes: bool  # it carries activations through the stage's layers


_ACKED = Rule(Owes.ACK, passed_on=True, computes=False)
_COMPUTED_ACKED = Rule(Owes.ACK, passed_on=True, computes=True)
_PREDICTED = Rule(Owes.PREDICTIONS, passed_on=True, computes=True)
_FORGOTTEN = Rule(Owes.NOTHING, passed_on=True, computes=False)

RULES: Final[dict[str, Rule]] = {
    Configure.kind: _ACKED,
    Prefill.kind: _COMPUTED_ACKED,
    "prefill+predict": _PREDICTED,  # the last chunk of a prefill
    Decode.kind: _PREDICTED,
    Verify.kind: _PREDICTED,
    Trim.kind: _ACKED,
    Stop.kind: _ACKED,
    Cancel.kind: _FORGOTTEN,
    Remember.kind: _FORGOTTEN,
    Probe.kind: Rule(Owes.STATUS, passed_on=False, computes=False),
}
_REPLY_TYPES: Final = (Ack, Predictions, Cancelled, Error, Status)


def is_reply(message: Message) -> bool:
    """Whether ``message`` is a reply, which only ever travels up a lane."""
    return isinstance(message, _REPLY_TYPES)


def rule_for(message: Message) -> Rule:
    """The row of `RULES` for a request; a reply has none.

    Raises:
        KeyError: ``message`` is a reply.
    """
    if isinstance(message, Prefill) and message.predict:
        return RULES["prefill+predict"]
    return RULES[message.kind]


def fails_upstream(message: Message, *, is_last: bool) -> bool:
    """Whether a stage reports a failure of ``message`` upstream (else on the return path).

    Stage 0 listens for predictions from the last stage on the return connection, and for
    everything else on the lane's connection down to stage 1 (where acks come up).
    """
    return not (is_last and rule_for(message).owes is Owes.PREDICTIONS)


class ReplyCheck(enum.Enum):
    """What stage 0 makes of a reply it reads."""

    TAKEN = "taken"  # the reply the request owes, on the connection it comes back on
    REFUSED = "refused"  # a stage's Error: the request failed there
    OUT_OF_STEP = "out of step"  # anything else: the lane cannot be trusted any more


def check_reply(owed: Owes, reply: Message, *, on_return: bool) -> ReplyCheck:
    """Check a reply read by stage 0 against the table.

    ``owed`` is what the request being answered owes; ``on_return`` says whether the reply
    came on a return connection (from the last stage) or on the lane's connection down to stage 1.
    A ``Cancelled`` answers a ``Cancel`` in place of the predictions it will never send.
    """
    if isinstance(reply, Error):
        return ReplyCheck.REFUSED
    expected: tuple[type, ...]
    if owed is Owes.ACK:
        expected, where = (Ack,), False
    elif owed is Owes.PREDICTIONS:
        expected, where = (Predictions, Cancelled), True
    elif owed is Owes.STATUS:
        expected, where = (Status,), False
    else:
        return ReplyCheck.OUT_OF_STEP  # nothing is owed: any reply is out of step
    if isinstance(reply, expected) and on_return == where:
        return ReplyCheck.TAKEN
    return ReplyCheck.OUT_OF_STEP
