"""What a stage says of itself when probed: `Status`, with its prefix cache's `PrefixStats`.

Its own module for the size of it: `stagerun._proto._messages` lists it with the other
messages and converts it like them (a map with exactly these keys, validated on
construction).
"""

from typing import Any, ClassVar, Final

import attrs

from ._fields import _ID_LIMIT, _as_tuple, _int_in, _int_tuple, _is_bool

#: A `Status`'s spans: ints per span, the kinds, and how many spans one carries at most.
SPAN_FIELDS: Final = 5  # start ns, end ns, window id, kind, batch
SPAN_COMPUTE: Final = 0
SPAN_STALE: Final = 1  # a stale verify window's compute, stopped or dropped
MAX_STATUS_SPANS: Final = 256

_ID = _int_in(_ID_LIMIT)
_SPANS = _int_tuple(limit=_ID_LIMIT, max_len=MAX_STATUS_SPANS * SPAN_FIELDS, non_empty=False)


@attrs.frozen
class PrefixStats:
    """A stage's prefix cache, as its `Status` reports it (counts since the stage started)."""

    enabled: bool = attrs.field(default=False, validator=_is_bool)
    blocks: int = attrs.field(default=0, validator=_ID)
    bytes: int = attrs.field(default=0, validator=_ID)
    max_bytes: int = attrs.field(default=0, validator=_ID)
    hits: int = attrs.field(default=0, validator=_ID)
    misses: int = attrs.field(default=0, validator=_ID)
    hit_tokens: int = attrs.field(default=0, validator=_ID)
    lookup_tokens: int = attrs.field(default=0, validator=_ID)
    stored_blocks: int = attrs.field(default=0, validator=_ID)
    evicted_blocks: int = attrs.field(default=0, validator=_ID)


@attrs.frozen
class Status:
    """A stage's answer to a `Probe`: what its caches hold, and what it computed lately.

    ``clock_ns``: the stage's monotonic clock as it answered (``time.perf_counter_ns``),
    which the prober maps onto its own; ``clock_id`` names that clock (processes of one
    host since its boot share it; 0: unknown). ``ticks`` and ``tick_items``: the batched forwards
    the stage has run since it started, and the forwards they computed (the batch size is
    the ratio of two readings' differences). ``spans``: the probed request's latest computes
    on the stage, `SPAN_FIELDS` ints each (start and end on ``clock_ns``'s clock, window id,
    `SPAN_COMPUTE` or `SPAN_STALE`, forwards in its tick), oldest first.
    """

    kind: ClassVar[str] = "status"
    request_id: int = attrs.field(validator=_ID)
    stage_index: int = attrs.field(validator=_ID)
    prefix: PrefixStats = attrs.field(
        default=PrefixStats(), validator=attrs.validators.instance_of(PrefixStats)
    )
    clock_ns: int = attrs.field(default=0, validator=_ID)
    clock_id: int = attrs.field(default=0, validator=_ID)
    ticks: int = attrs.field(default=0, validator=_ID)
    tick_items: int = attrs.field(default=0, validator=_ID)
    spans: tuple[int, ...] = attrs.field(default=(), converter=_as_tuple, validator=_SPANS)

    @spans.validator
    def _check_spans(self, attribute: "attrs.Attribute[Any]", value: tuple[int, ...]) -> None:
        if len(value) % SPAN_FIELDS:
            raise ValueError(
                f"Status.spans must hold {SPAN_FIELDS} ints per span, got {len(value)} ints."
            )
        for at in range(0, len(value), SPAN_FIELDS):
            start, end, _window, kind, _batch = value[at : at + SPAN_FIELDS]
            if end < start or kind not in (SPAN_COMPUTE, SPAN_STALE):
                raise ValueError(
                    f"Status.spans[{at // SPAN_FIELDS}] must end after it starts and be of "
                    f"kind {SPAN_COMPUTE} or {SPAN_STALE}, got {value[at : at + SPAN_FIELDS]}."
                )
